"""Leaf tools, each a command that nothing in chatrl imports: the run report (``report``), the token-level
inspector (``inspector``) and the exact replay (``replay``) of a run's evidence, the web chat
(``web_chat``), the reference reward server (``reward_server``) and the chat-template checker
(``check_template``). Run one with ``python -m chatrl.tools.NAME``."""
