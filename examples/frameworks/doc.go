// Package frameworks wires the idempotency middleware into chi and echo.
// Its examples are the wiring docs/http.md shows, and its tests check the
// middleware's contract through each router: chi's Use and With take
// Guard.Middleware as it is; echo takes the adapter of
// github.com/idempotency-go/idempotency/echo, and a test shows why
// echo.WrapMiddleware alone is not enough.
package frameworks
