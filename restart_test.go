package idempotency_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
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
//
// With RedisOptions.Fsync.Master, what decides an operation waits for the
// master's fsync (WAITAOF), which needs appendfsync always. A server that
// cannot wait (appendfsync no, which never fsyncs on its own; everysec,
// where WAITAOF may answer before the fsync; or one without WAITAOF, such
// as Redis 7.0) is refused before the load: CheckPersistence and the first
// call name the reason, and no operation runs. Run it on Valkey with
// IDEMPOTENCY_REDIS_SERVER=valkey-server.
func TestRedisRestart(t *testing.T) {
	t.Parallel() // a server of its own: runs beside the other long suites
	fsync := idempotency.RedisOptions{Fsync: idempotency.Fsync{Master: true}}
	for _, c := range []struct {
		name    string
		args    []string
		opts    idempotency.RedisOptions
		durable bool
		refused bool // on every server
	}{
		{"redis", []string{"--appendonly", "yes", "--appendfsync", "always"}, idempotency.RedisOptions{}, true, false},
		{"redis-everysec", []string{"--appendonly", "yes", "--appendfsync", "everysec"}, idempotency.RedisOptions{}, false, false},
		{"redis-nofsync", nil, idempotency.RedisOptions{}, false, false}, // StartRedis's default: no AOF, no RDB
		{"redis-fsync-always", []string{"--appendonly", "yes", "--appendfsync", "always"}, fsync, true, false},
		{"redis-fsync-everysec", []string{"--appendonly", "yes", "--appendfsync", "everysec"}, fsync, false, true},
		{"redis-fsync-appendfsync-no", []string{"--appendonly", "yes", "--appendfsync", "no"}, fsync, false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := testserver.StartRedis(t, c.args...)
			store, err := idempotency.NewRedisStore(srv.Client(), c.opts)
			require.NoError(t, err)
			t.Cleanup(func() { store.Close() })
			if c.opts.Fsync.Master {
				switch refused := refusedFsync(t, store); {
				case c.refused:
					require.Error(t, refused, "a server that cannot wait for its fsync was not refused")
					return
				case refused != nil:
					require.ErrorContains(t, refused, "has no WAITAOF")
					return
				}
			}
			restarttest.Run(t, restarttest.Rig{
				Name: c.name, Fault: "kill", Store: store, Durable: c.durable,
				Kill:  func(t *testing.T) { srv.Stop(t) },
				Start: func(t *testing.T) { srv.Restart(t) },
			})
		})
	}
}

// refusedFsync returns why s's server cannot wait for its append-only file
// as s asks, or nil when it can. When it cannot, CheckPersistence and the
// first call refuse it, naming why, and no operation runs.
func refusedFsync(t *testing.T, s *idempotency.RedisStore) error {
	ctx := t.Context()
	_, checked := s.CheckPersistence(ctx)
	if checked == nil {
		return nil
	}
	require.ErrorContains(t, checked, "RedisOptions.Fsync cannot be met")
	ran := false
	_, err := idempotency.New(s, idempotency.Options{}).Do(ctx, idempotency.Key{Name: "refused"}, idempotency.FingerprintOf("op", nil),
		func(context.Context) (idempotency.Response, error) {
			ran = true
			return idempotency.Response{Status: 201}, nil
		})
	require.Error(t, err)
	assert.NotErrorIs(t, err, idempotency.ErrUnavailable)
	assert.False(t, ran, "the operation ran")
	why, _ := strings.CutPrefix(checked.Error(), "idempotency: RedisOptions.Fsync cannot be met: ")
	assert.ErrorContains(t, err, why, "the first call says what CheckPersistence said")
	t.Logf("refused before the load: %v", checked)
	return checked
}
