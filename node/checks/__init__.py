"""Useful-work checks on the node: what group members' contributions do to the loss,
measured off the training thread (:mod:`node.checks.work`), on inputs the training
thread hands over (:mod:`node.checks.inputs`), with contributions fetched on the
transport's loop (:mod:`node.checks.fetch`), measured on a model of the checks' own
(:mod:`node.checks.measure`) and other checkers' records believed or refused
(:mod:`node.checks.judge`). The rules are :mod:`verification.usefulness` and
:mod:`verification.workscores`."""

from node.checks.fetch import Fetcher
from node.checks.inputs import CheckSettings, ExchangeBase, RoundBook, RoundInputs
from node.checks.measure import Measurer
from node.checks.work import UsefulWork

__all__ = [
    "CheckSettings",
    "ExchangeBase",
    "Fetcher",
    "Measurer",
    "RoundBook",
    "RoundInputs",
    "UsefulWork",
]
