// Package faultsuite holds no code, only tests: it runs the library under
// load against real servers (redis-server, a Redis Cluster, PostgreSQL)
// through Toxiproxy, run in process, and checks that network faults never
// cost what the library promises.
//
// Several Guards share each store, as several instances of a service
// would, each reaching every server through proxies of its own. Many
// goroutines call them with the same keys at once and retry keys already
// answered, while the proxies add latency and jitter, reset connections
// (before and after the server applied a request, pub/sub and LISTEN
// connections included), drop replies of writes the server applied, limit
// bandwidth and slice replies, and cut one instance off for longer than a
// lease. The operations of every other key are made of steps
// (idempotency.Step), and the ledger keeps each run of a step, however
// often it runs. Every run is then checked, with the faults removed, for
// operations run twice, steps run again once Step had confirmed their
// recording, completions lost or replaced, results of a step that differ
// from one answer to the next or that no run of the step returned, answers
// that are neither a stored response nor ErrUnavailable, ErrInFlight or
// ErrFenced, and duplicates left waiting though their original had
// finished; each run reports its counts through internal/testkit/report.
//
// It is a module of its own, so that the library's go.mod never requires
// Toxiproxy.
package faultsuite
