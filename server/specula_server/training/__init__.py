"""Training speculators (Medusa heads, MLP speculators) by self-distillation: `specula-train`."""
