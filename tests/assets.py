"""The offline assets (python -m offline.fetch_assets) as the tests ask for them."""
import os

import pytest

from offline.fetch_assets import AssetsMissing, asset_path


def require_asset(*parts: str):
    """asset_path() for tests: skip when missing, but fail under CI=true (CI must have the
    assets)."""
    try:
        return asset_path(*parts)
    except AssetsMissing as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(e), pytrace=False)
        pytest.skip(str(e))
