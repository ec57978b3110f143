"""The contract both sides share: messages and codec, error codes, topics, the fast ack
decoder, the JSON Schemas. With ``controlplane.kafka``, all of ``controlplane`` that ``workers``
may import."""
