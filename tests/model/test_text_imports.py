"""The tokenizer and chat template are used by the HTTP process, which must never load paddle."""

from __future__ import annotations

import subprocess
import sys


def test_tokenizer_and_chat_template_do_not_import_paddle():
    code = ("import sys, mtpserve.tokenizer, mtpserve.chat_template; "
            "sys.exit(1 if any(m == 'paddle' or m.startswith('paddle.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
