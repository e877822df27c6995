import sys

from omni_serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
