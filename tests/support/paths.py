"""Where the tests find the repository: its root, for the files they read and the scripts they run
by path, and the hostile peer the fault tests start."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROGUE_PEER = ROOT / "tests" / "support" / "rogue_peer.py"
