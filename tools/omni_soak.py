"""Load and soak an omni server: `omni-soak` (see omni_tools/soak/cli.py), runnable from a checkout.

    .venv/bin/python tools/omni_soak.py --concurrency 16 --duration-s 600 --out soak.json
"""
import sys

from omni_tools.soak.cli import main

if __name__ == "__main__":
    sys.exit(main())
