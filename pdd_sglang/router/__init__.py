"""The PDD router: one front door that places each request on P->MD or P->RLD->MD, fans it out to
its servers, and splices the relay's and main's streams (docs/design.md, "The PDD router")."""
