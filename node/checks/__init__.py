"""Useful-work checks on the node: what group members' contributions do to the loss,
measured off the training thread (:mod:`node.checks.work`, given what the node hands
it, :mod:`node.checks.parts`), on inputs the training thread hands over
(:mod:`node.checks.inputs`), with contributions fetched on the transport's loop
(:mod:`node.checks.fetch`), this node's own checks made (:mod:`node.checks.own`) and
measured on a model of the checks' own (:mod:`node.checks.measure`), and every record
counted, other checkers' believed or refused (:mod:`node.checks.records`,
:mod:`node.checks.judge`). The rules are :mod:`verification.usefulness` and
:mod:`verification.workscores`."""

from node.checks.fetch import Fetcher, FetchSettings
from node.checks.inputs import CheckSettings, ExchangeBase, RoundBook, RoundInputs
from node.checks.measure import Measurer
from node.checks.parts import CheckHooks, CheckParts
from node.checks.work import UsefulWork

__all__ = [
    "CheckHooks",
    "CheckParts",
    "CheckSettings",
    "ExchangeBase",
    "FetchSettings",
    "Fetcher",
    "Measurer",
    "RoundBook",
    "RoundInputs",
    "UsefulWork",
]
