"""The names of the tensors that travel between the server and the nodes, each written once.

A method's sharing rule (``spec.MethodSpec.shares``), the server's payloads and reply
checks, and the clients' replies all name tensors through these. LoRA adapters and reprogramming
models travel under their own module names (``models``), which the sharing rule reads from the
loaded model.
"""

CTX = "ctx"  # a prompt's context vectors [M, D]: PromptFL's and pFedMoAP's global prompt, both ways
EXPERTS = "experts"  # pFedMoAP: other nodes' prompts a node receives as experts [K, M, D]
GLOBAL_CTX = "global_ctx"  # the global prompt the global/local methods receive (DP-FPL, FedOTP, FedPGP)
GLOBAL_GRAD = "global_grad"  # ... and the clipped gradient of it they return, which the server noises
