"""The names of ``atoll run --byzantine`` modes: distinct, grouped, each implemented."""

from __future__ import annotations

from node.swarm.fault_modes import ALL_MODES, COMMIT_MODES, MODES, QUIET_MODES


def test_every_mode_is_named_once_in_one_group() -> None:
    assert ALL_MODES == MODES + COMMIT_MODES + QUIET_MODES
    assert len(set(ALL_MODES)) == len(ALL_MODES)
    assert "equivocate" in COMMIT_MODES and "silent" in QUIET_MODES and "sign_flip" in MODES


def test_the_command_line_names_every_mode_and_each_has_a_behaviour() -> None:
    from node.cli.commands import atoll_parser
    from node.swarm.byzantine import make_behaviour

    run = atoll_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    byzantine = next(a for a in run._actions if "--byzantine" in a.option_strings)
    for mode in ALL_MODES:
        assert mode in byzantine.help
        make_behaviour(mode)  # an unknown mode would raise
