"""The browser side: train.js (the JS driver of step bundles), the digits demo page, and serve.py (its server)."""
