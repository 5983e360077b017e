"""fedvlm: privacy-preserving federated fine-tuning of vision-language models, as a Flower app.

The design card's folders live here, one package so that installing the project adds one
top-level module: ``server_app`` (the ServerApp and its round loop), ``client_app`` (the
ClientApp and each family's client), ``strategies`` (aggregation, server-side noise, FedRand's
draws), ``models``, ``data``, ``privacy``, ``methods`` (the registry), ``runconfig``.
"""
