"""The views of a sharded model (parity/training/view.py's protocol) that the recorder reads a user's loop through,
picked by table.py; a framework's translated view (parity/frameworks/<name>/view.py) builds on translated.py."""
