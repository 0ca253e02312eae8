"""Adapters that put the dispatch engine into training frameworks.

Each adapter lives in its own module and imports its framework lazily, so that
importing ``dispatch.integrations.<name>`` never requires the framework itself.
"""
