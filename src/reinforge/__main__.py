"""`python -m reinforge ...`, the same as the `reinforge` command; what torchrun launches:
`torchrun --nproc-per-node 8 -m reinforge train CONFIG.toml`."""

import sys

from reinforge.cli import main

sys.exit(main())
