"""The bench programs' argument parser: a bad flag is one line on stderr (exit 2), not argparse's usage block.
Torch-free, so a program can check its flags before it imports torch (bench e2e does)."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"{self.prog}: error: {message} ({self.prog} --help)", file=sys.stderr)
        sys.exit(2)
