"""What the processes that serve HTTP share (the gateway, the host's dashboard): server-sent
event responses and uvicorn without its own signal handling. No room's code."""
