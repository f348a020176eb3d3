import sys
from pathlib import Path

# the scripts and common.py live in the repository root; helpers.py beside this file
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
