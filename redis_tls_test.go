package idempotency_test

import (
	"context"
	"crypto/tls"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// TestRedisTLS runs the store over TLS, as docs/security.md sets it up: a
// server that requires a client certificate of the test's authority, and a
// client, made from a rediss:// URL as the operator command makes its own,
// that trusts that authority only. The waiters' pub/sub connection takes
// the same path (the suite's WakeUp). A client without TLS, without the
// authority or without a certificate is refused.
func TestRedisTLS(t *testing.T) {
	t.Parallel() // a server of its own: runs beside the other long suites
	files := testserver.NewTLSFiles(t)
	_, addr := testserver.StartRedisTLS(t, files)
	ctx := context.Background()
	o, err := redis.ParseURL("rediss://" + addr)
	require.NoError(t, err)
	require.NotNil(t, o.TLSConfig, "rediss:// asks for TLS")
	clientTLS := files.ClientConfig(t)
	o.TLSConfig.RootCAs, o.TLSConfig.Certificates = clientTLS.RootCAs, clientTLS.Certificates
	o.ContextTimeoutEnabled = true
	c := redis.NewClient(o)
	s := redisStore(t, c)

	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness { return idempotencytest.Harness{Store: s} })
	require.NoError(t, s.CheckEviction(ctx))
	_, err = s.CheckPersistence(ctx)
	require.ErrorIs(t, err, idempotency.ErrNoPersistence, "the test's server keeps nothing across a restart")

	other := testserver.NewTLSFiles(t).ClientConfig(t)
	for name, cfg := range map[string]*tls.Config{
		"no TLS":                nil,
		"another authority":     {RootCAs: other.RootCAs, Certificates: clientTLS.Certificates},
		"no client certificate": {RootCAs: clientTLS.RootCAs},
	} {
		bad := redis.NewClient(&redis.Options{Addr: addr, TLSConfig: cfg, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
		assert.Error(t, bad.Ping(ctx).Err(), "%s: refused", name)
		bad.Close()
	}
}
