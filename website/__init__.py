"""The course as a website: ``python -m website`` builds it into ``build/site/`` (see build.py)."""
