package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// testCA is a certificate authority made for one test, whose files are in
// dir: ca.pem, and NAME.pem and NAME-key.pem for each certificate issued.
type testCA struct {
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	ca := &testCA{dir: t.TempDir(), cert: cert, key: key}
	writePEM(t, ca.path("ca.pem"), "CERTIFICATE", der)
	return ca
}

func (ca *testCA) path(name string) string { return filepath.Join(ca.dir, name) }

// issue makes the certificate name.pem, with its key name-key.pem, for
// 127.0.0.1 and localhost, good for a server and a client.
func (ca *testCA) issue(t *testing.T, name string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	require.NoError(t, err)
	writePEM(t, ca.path(name+".pem"), "CERTIFICATE", der)
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	writePEM(t, ca.path(name+"-key.pem"), "PRIVATE KEY", kder)
}

func writePEM(t *testing.T, path, kind string, der []byte) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600))
}

// TestProxyTLS: the proxy serves its clients over TLS with -tls-cert and
// -tls-key, and reaches an https upstream that requires a client
// certificate with -upstream-ca, -upstream-cert and -upstream-key.
func TestProxyTLS(t *testing.T) {
	s := stores(t)["redis"](t)
	ca := newTestCA(t)
	for _, name := range []string{"proxy", "upstream", "client"} {
		ca.issue(t, name)
	}
	u := startPython(t, "testdata/upstream.py", "--tls", ca.path("upstream.pem"), ca.path("upstream-key.pem"), ca.path("ca.pem"))
	u.url = strings.Replace(u.url, "http://", "https://", 1)
	p := startProxy(t, s.flags, u, "-tls-cert", ca.path("proxy.pem"), "-tls-key", ca.path("proxy-key.pem"),
		"-upstream-ca", ca.path("ca.pem"), "-upstream-cert", ca.path("client.pem"), "-upstream-key", ca.path("client-key.pem"))
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	base := strings.Replace(p.url, "http://", "https://", 1)
	for i, want := range []string{"", "true"} {
		req, err := http.NewRequest(http.MethodPost, base+"/charges", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "tls-1")
		req.Header.Set("X-Account-ID", "acct_1")
		resp, err := client.Do(req)
		require.NoError(t, err, "request %d", i)
		resp.Body.Close()
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, want, resp.Header.Get("Idempotent-Replayed"))
	}
	assert.Equal(t, http.StatusBadRequest, post(t, p.url, "/charges", "acct_1", "tls-1", `{}`).status,
		"plain HTTP on the TLS listener")

	noClientCert := startProxy(t, s.flags, u, "-upstream-ca", ca.path("ca.pem"))
	assert.Equal(t, http.StatusBadGateway, post(t, noClientCert.url, "/charges", "acct_1", "tls-2", `{}`).status,
		"an upstream that requires a client certificate refused the proxy without one")
}

// TestProxyUnixUpstream: -upstream unix:/path reaches an upstream on a Unix
// socket.
func TestProxyUnixUpstream(t *testing.T) {
	s := stores(t)["redis"](t)
	sock := filepath.Join(t.TempDir(), "upstream.sock")
	startPython(t, "testdata/upstream.py", "--unix", sock)
	p := startProxy(t, s.flags, upstream{url: "unix:" + sock})
	first := decodeCharge(t, post(t, p.url, "/charges", "acct_1", "unix-1", `{}`))
	again := post(t, p.url, "/charges", "acct_1", "unix-1", `{}`)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, first.ID, decodeCharge(t, again).ID)
	code, body := get(t, p.admin+"/readyz")
	assert.Equal(t, http.StatusOK, code, body)
}
