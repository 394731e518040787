"""The router: prefix index, load view, worker selection, conditional disaggregation, dispatch,
the OpenAI front door, replica sync, metrics and traces (docs/router.md)."""
