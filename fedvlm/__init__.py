"""fedvlm: privacy-preserving federated fine-tuning of vision-language models, as a Flower app.

The design card's folders live here, one package so that installing the project adds one
top-level module: ``server_app`` (the ServerApp and its round loop), ``client_app`` (the
ClientApp and each family's client), ``strategies`` (aggregation, server-side noise, FedRand's
draws), ``models``, ``data``, ``privacy``, ``methods`` (the registry), ``runconfig``.
"""

import os

# Torch's OpenMP threads sleep rather than spin while they wait, unless the user chose otherwise.
# Simulated clients, a pretraining server and organisations' nodes share the cores: spinning
# threads then slow each other (1.5x for two pretrainings side by side, far more on a loaded
# machine; docs/results/deployment.md). Set here, before anything imports torch, because OpenMP
# reads it once, when torch loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
