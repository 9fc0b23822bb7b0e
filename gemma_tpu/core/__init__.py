"""Core: what every stage uses and nothing above it defines: `UserError`, typed configs loaded from YAML
with dotted overrides, the CLI helper (which keeps torch and pandas out of processes that never use them:
`lean_imports`), atomic directory publishing, progress lines, accelerator facts."""
