"""`/v1/realtime`: OpenAI's Realtime API (WebSocket) on omni-openai.

Runs in the omni-openai process. One WebSocket is one session (session.py):
client events are parsed and checked (client_events.py), the conversation is
kept as items (conversation.py), each response streams the whole conversation
through AsyncOmniClient (response.py) and goes back as OpenAI's server events
(server_events.py); endpoint.py holds the socket loop and the limits
(settings.py), metrics.py the Prometheus families.
"""
from omni_client.openai_server.realtime.endpoint import RealtimeHub, serve
from omni_client.openai_server.realtime.metrics import RealtimeMetrics
from omni_client.openai_server.realtime.settings import RealtimeSettings, add_arguments

__all__ = ["RealtimeHub", "RealtimeMetrics", "RealtimeSettings", "add_arguments", "serve"]
