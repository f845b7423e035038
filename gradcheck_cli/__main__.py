"""``python -m gradcheck_cli`` is the ``attn-gradcheck`` command."""
from .cli import main

main(prog_name="attn-gradcheck")
