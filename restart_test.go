package idempotency_test

import (
	"testing"

	"github.com/idempotency-go/idempotency/internal/testkit/restarttest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// Issue 15's store restarts on redis-server: kill -9 under load, then a
// start on the same port and directory. With every write fsynced to the
// append-only file before its reply, nothing a caller was answered may be
// lost, and tokens keep growing; without persistence, or with a fsync a
// second, the test measures what the restart lost. In every case the same
// store and client fail closed while the server is down and serve again
// once it is back.
func TestRedisRestart(t *testing.T) {
	for _, c := range []struct {
		name    string
		args    []string
		durable bool
	}{
		{"redis", []string{"--appendonly", "yes", "--appendfsync", "always"}, true},
		{"redis-everysec", []string{"--appendonly", "yes", "--appendfsync", "everysec"}, false},
		{"redis-nofsync", nil, false}, // StartRedis's default: no AOF, no RDB
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := testserver.StartRedis(t, c.args...)
			restarttest.Run(t, restarttest.Rig{
				Name: c.name, Fault: "kill", Store: redisStore(t, srv.Client()), Durable: c.durable,
				Kill:  func(t *testing.T) { srv.Stop(t) },
				Start: func(t *testing.T) { srv.Restart(t) },
			})
		})
	}
}
