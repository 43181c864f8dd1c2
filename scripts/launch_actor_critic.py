#!/usr/bin/env python
"""Run the actor/critic demo (same as ``rankmesh demo``); see ``--help`` and docs/megatron.md."""

import sys

from rankmesh.demo_cli import main

if __name__ == "__main__":
    sys.exit(main())
