"""Small helpers shared by the server, the clients and the tools."""
