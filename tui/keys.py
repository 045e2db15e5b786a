"""Every key of the app: the screens' tabs, the app's bindings and the help's list of what each
does (one module, so that `?` and the bindings agree; tests/tui/test_app.py checks they do)."""

from __future__ import annotations

from textual.binding import Binding, BindingType

SCREENS: tuple[tuple[str, str], ...] = (
    ("overview", "1 Overview"),
    ("ranks", "2 Ranks"),
    ("pipeline", "3 Pipeline"),
    ("collectives", "4 Collectives"),
    ("offload", "5 Offload"),
    ("gpus", "6 GPUs"),
    ("alerts", "7 Alerts & actions"),
    ("topology", "8 Topology"),
)
SCREEN_IDS = tuple(s for s, _ in SCREENS)

# The keys are the app's, not the panes': Textual looks a key up along the focus chain, and
# these act whatever has focus (the tabs, a table) and across screens (m from any screen goes to
# Ranks, s sorts the screen shown, y / n decide on two). Keys of one widget stay on it
# (HeatmapView's arrows and enter, the modals'). This order is the footer's.
BINDINGS: list[BindingType] = [
    *[Binding(str(i + 1), f"show('{sid}')", title.split(" ", 1)[1], show=False) for i, (sid, title) in enumerate(SCREENS)],
    Binding("tab", "cycle(1)", "Next screen", show=False, priority=True),
    Binding("shift+tab", "cycle(-1)", "Previous screen", show=False, priority=True),
    Binding("slash", "filter", "Filter"),
    Binding("s", "sort", "Sort"),
    Binding("m", "metric", "Metric"),
    Binding("a", "level", "Aggregate"),
    Binding("escape", "back", "Back"),
    Binding("p", "pause", "Pause"),
    Binding("left_square_bracket", "step(-1)", "Step −1", show=False),
    Binding("right_square_bracket", "step(1)", "Step +1", show=False),
    Binding("left_curly_bracket", "step(-10)", "Step −10", show=False),
    Binding("right_curly_bracket", "step(10)", "Step +10", show=False),
    Binding("home", "step_to('first')", show=False),
    Binding("end", "step_to('last')", show=False),
    Binding("y", "decide('approve')", "Approve", show=False),
    Binding("n", "decide('reject')", "Reject", show=False),
    Binding("question_mark", "help", "Help"),
    Binding("q", "quit", "Quit"),
]


#: Every binding with what it does, for `?` and docs/tui.md (one list, so they agree).
HELP: tuple[tuple[str, str], ...] = (
    ("1 … 8, tab / shift+tab", "switch screen (or click a tab)"),
    ("/", "filter the screen's rows (Ranks: stage=1 replica=0 tp=0 rank=3 node=NAME z>3, or a rank number)"),
    ("s", "sort (Ranks side table: z / rank / value; Collectives: p99 / calls / size / op)"),
    ("m", "Ranks: next metric (compute, collective wait, step time, memory, GPU util); Topology: latency / busbw"),
    ("a", "Ranks: aggregation level (auto, rank, replica, node)"),
    ("arrows, mouse", "Ranks: move the cell cursor (click a cell to select it)"),
    ("enter", "drill down (an aggregated cell → its ranks; a rank → its phases, collectives, memory)"),
    ("esc", "back (out of a drill-down, a filter, this help)"),
    ("[ ] { } home end", "replay a file: step −1 / +1 / −10 / +10 / first / last"),
    ("p", "pause / resume live updates"),
    ("y / n", "approve / reject a proposal (advise mode), after a confirmation: on Alerts & actions the selected "
              "row, on the Overview the newest proposal; live only, with --control-token-file where needed"),
    ("?", "this help"),
    ("q", "quit"),
)
