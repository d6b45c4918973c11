"""Registers the conformance plugin when it is not loaded already (by its entry point).

The plugin (``plugin.py``) is what ``pytest -p clipbench`` and the ``pytest11`` entry point
load; this conftest only makes ``pytest conformance`` work from a checkout where plugins do
not autoload (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), without ever registering it twice.
"""

from __future__ import annotations

from clipbench.conformance import plugin


def pytest_addoption(parser, pluginmanager):
  if not pluginmanager.has_plugin("clipbench") and not pluginmanager.is_registered(plugin):
    # pytest_addoption and pytest_configure are historic hooks: a plugin registered here
    # still receives both.
    pluginmanager.register(plugin, "clipbench")
