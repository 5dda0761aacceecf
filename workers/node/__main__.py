from workers.node.layout import ensure_layout

# Before anything is imported or started: this may re-exec the node (engine.address_layout).
_layout_note = ensure_layout()

from workers.node.agent import main  # noqa: E402

main(_layout_note)
