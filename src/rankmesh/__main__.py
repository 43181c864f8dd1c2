"""``python -m rankmesh``: the same command line as the ``rankmesh`` console script."""

import sys

from rankmesh.cli import main

if __name__ == "__main__":
    sys.exit(main())
