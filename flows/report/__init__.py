"""The run's report, flow side: its text, tables and lineage as pure functions (`tables`), its
images drawn once per content (`images`) from the training curves (`plots`) and the stage graph
(`graph_plot`), and each stage's health in a line (`health_summary`)."""
