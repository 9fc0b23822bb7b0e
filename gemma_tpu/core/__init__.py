"""Core: what every stage uses and nothing above it defines: `UserError`, typed configs loaded from YAML
with dotted overrides, the CLI helper, atomic directory publishing, progress lines, accelerator facts."""
