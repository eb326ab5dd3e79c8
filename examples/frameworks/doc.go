// Package frameworks wires the idempotency middleware into chi and echo.
// Its examples are the wiring docs/http.md shows, and its tests check the
// middleware's contract through each router: chi's Use and With take
// Guard.Middleware as it is; echo takes it through echo.WrapMiddleware, with
// the handler's errors and panics answered inside it.
package frameworks
