"""The request routers living in this process, by Serve application name.

Its own module because Serve pickles a router's module by value: a registry kept there would be
a copy in every process. Routers reach this one through the module (``registry.ROUTERS``), which
is imported by name on the other side.
"""

from __future__ import annotations

import weakref
from typing import Any

ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
