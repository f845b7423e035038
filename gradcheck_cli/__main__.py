"""``python -m gradcheck_cli`` is the ``attn-gradcheck`` command."""
try:
    from .console import main
except KeyboardInterrupt:  # Ctrl-C while the console module itself loads: still one line and exit 130
    import os
    import sys
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)  # ExitCode.INTERRUPTED, written out: nothing more is imported once Ctrl-C has hit

main()
