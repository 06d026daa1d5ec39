"""The web explorer and its ES modules, shipped in the package and served by the service.

``index.html`` (served at ``/`` and ``/explorer``), ``explorer.js`` (the page), ``attnscope.js``
(the API client and wire decoders, importable by other front ends: ``import {decodeTensor}
from "/static/web/attnscope.js"``), ``views.js`` (the heat map, line view, head grid and
trajectory drawings, shared with the notebook views), ``explorer.css``; ``vendor/swagger-ui``
holds the Swagger UI 5 files /docs needs (``scripts/vendor-swagger-ui``).
"""

from __future__ import annotations

from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent
SWAGGER_UI_DIR = WEB_DIR / "vendor" / "swagger-ui"
WEB_FILES = ("explorer.js", "attnscope.js", "views.js", "explorer.css")
"""Served under ``/static/web/`` (nothing else in the folder is)."""
SWAGGER_UI_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png")
"""Served under ``/static/swagger-ui/``: what /docs loads."""
