"""The torch-free data types the flow passes along: Profile, Cluster, Plan (each with its JSON format).

Import them from their modules (`autopp.data.plan`, ...): this package re-exports nothing, so that loading one does
not load the others (the profile loads pandas and networkx)."""

__all__: list[str] = []
