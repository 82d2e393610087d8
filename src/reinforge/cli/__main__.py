"""`python -m reinforge.cli ...`: the same as `python -m reinforge ...` and the `reinforge`
command (the CLI was one module before it became a package; scripts that name it keep working)."""

import sys

from reinforge.cli import main

sys.exit(main())
