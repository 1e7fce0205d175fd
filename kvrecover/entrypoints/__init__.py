"""Online serving and the command line, by role: `openai/` (what both apps share),
`server/` (`kvrecover serve`), `proxy/` (`kvrecover proxy`), `cli/` (every command)."""
