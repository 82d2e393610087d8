"""The tool-call parser picked from the chat template's own markers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reinforge.server.app import default_tool_parser


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<tool_call>\\n' + tool_call | tojson }}<|im_start|>", "hermes"),
        ("<|start_header_id|>{{ '<|python_tag|>' }}", "llama3_json"),
        ("[INST]{{ '[TOOL_CALLS]' }}", "mistral"),
        ("<|im_start|>{{ message['content'] }}", "hermes"),  # no markers: the common default
        (None, "hermes"),
    ],
)
def test_default_tool_parser(template, expected):
    assert default_tool_parser(SimpleNamespace(chat_template=template)) == expected
