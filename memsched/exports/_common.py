"""Shared by the exports: how a module is labelled."""

from __future__ import annotations


def label(module: str) -> str:
    return module if module else "(root)"
