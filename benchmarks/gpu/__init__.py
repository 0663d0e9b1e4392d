"""The one-command GPU check (``check.sh``) and its GPU benchmark rows."""
