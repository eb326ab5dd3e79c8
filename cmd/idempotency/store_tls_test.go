package main

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// TestStoreTLS: the command and the proxy reach each store over TLS with
// the flags docs/security.md gives, verifying the server against the
// test's authority and presenting a client certificate: Redis with a
// rediss:// -redis and -redis-ca, -redis-cert, -redis-key; PostgreSQL with
// sslmode=verify-full, sslrootcert, sslcert and sslkey in -postgres. The
// servers admit no client without TLS and that certificate. A charge
// through the proxy is then inspected with the command.
func TestStoreTLS(t *testing.T) {
	files := testserver.NewTLSFiles(t)
	t.Run("redis", func(t *testing.T) {
		_, addr := testserver.StartRedisTLS(t, files)
		flags := []string{"-redis", "rediss://" + addr, "-redis-ca", files.CA, "-redis-cert", files.ClientCert, "-redis-key", files.ClientKey}
		chargeAndInspect(t, flags)

		code, _, stderr := command(t, "", "-redis", "rediss://"+addr, "-redis-cert", files.ClientCert, "-redis-key", files.ClientKey, "stats")
		assert.Equal(t, 1, code, "without -redis-ca the system's CAs do not know the server's")
		assert.Contains(t, stderr, "certificate")
		code, _, stderr = command(t, "", "-redis", "redis://"+addr, "-redis-ca", files.CA, "stats")
		assert.Equal(t, 2, code, "-redis-ca with a redis:// URL")
		assert.Contains(t, stderr, "rediss://")
		code, _, _ = command(t, "", "-redis", "rediss://"+addr, "-redis-ca", files.CA, "-redis-cert", files.ClientCert, "stats")
		assert.Equal(t, 2, code, "-redis-cert without -redis-key")
	})
	t.Run("postgres", func(t *testing.T) {
		pg := testserver.StartPostgresTLS(t, files)
		chargeAndInspect(t, []string{"-postgres", pg.TLSDSN(files)})

		code, _, stderr := command(t, "", "-postgres", pg.DSN, "stats")
		assert.Equal(t, 1, code, "a DSN without TLS")
		assert.Contains(t, stderr, "no encryption")
	})
}

// chargeAndInspect charges through a proxy on the store storeFlags name,
// which migrates a PostgreSQL table, and then inspects the charge's record
// with the command: both reach the store with storeFlags alone.
func chargeAndInspect(t *testing.T, storeFlags []string) {
	t.Helper()
	u := startUpstream(t)
	p := startProxy(t, storeFlags, u)
	c := decodeCharge(t, post(t, p.url, "/charges", "acct_tls", "tls-1", `{"amount":100}`))
	p.stop()
	code, stdout, _ := command(t, "", append(append([]string{}, storeFlags...), "-json", "inspect", "acct_tls", "tls-1")...)
	require.Equal(t, 0, code)
	var rec jsonRecord
	require.NoError(t, json.Unmarshal([]byte(stdout), &rec), stdout)
	assert.Equal(t, "completed", rec.State)
	assert.Equal(t, http.StatusCreated, rec.Status, "the charge %s", c.ID)
}
