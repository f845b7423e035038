"""``python -m gradcheck_cli`` is the ``attn-gradcheck`` command."""
from .console import main

main()
