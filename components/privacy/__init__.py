"""What counts as a secret or as personal data: one owner, used by everyone who asks.

- secrets.py: credentials (API keys and tokens by their formats, AWS secret access keys,
  private keys, bearer tokens, values labelled password / secret / api_key / ...), as
  patterns. The data gate (components/validation.py, components/data/policies.py) finds them
  with find_secrets(); the gateway's Presidio analyzer (components/gateway/pii.py) recognises
  them from the same list, so prompts, answers and the request log (which the gateway's
  analyzer redacts) agree with the gate.
- personal.py: personal data the gate looks for in training answers (email, card number,
  phone, IBAN) and the documentation values that are nobody's (example.com, 555-01xx).

tests/test_privacy.py plants every kind in texts for all three users.
"""
