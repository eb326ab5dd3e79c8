package testserver

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TLSFiles are the PEM files of a certificate authority made for one test,
// and of a server and a client certificate it issued, in a directory of the
// test's. Both certificates name 127.0.0.1 and localhost, so a client that
// verifies the server's name against either accepts it; each is good for
// its own side only (ExtKeyUsage). Every key is in its own file, mode 0600.
type TLSFiles struct {
	// CA is the authority's certificate: what a client trusts to verify the
	// server, and what a server trusts to verify client certificates.
	CA string
	// ServerCert and ServerKey are the server's certificate and key.
	ServerCert, ServerKey string
	// ClientCert and ClientKey are a client's certificate and key.
	ClientCert, ClientKey string
}

// NewTLSFiles makes a fresh certificate authority, valid from an hour ago
// to a day from now, and issues a server and a client certificate with it,
// writing every file into a directory of t's own.
func NewTLSFiles(t testing.TB) TLSFiles {
	t.Helper()
	dir := t.TempDir()
	f := TLSFiles{
		CA:         filepath.Join(dir, "ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client-key.pem"),
	}
	if err := f.write(); err != nil {
		t.Fatalf("testserver: making test certificates: %v", err)
	}
	return f
}

// write makes the authority and the two certificates into f's paths.
func (f TLSFiles) write() error {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := certTemplate(1, "testserver CA")
	caTmpl.IsCA, caTmpl.BasicConstraintsValid = true, true
	caTmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	if err := writePEM(f.CA, "CERTIFICATE", caDER); err != nil {
		return err
	}
	if err := issue(ca, caKey, 2, "server", x509.ExtKeyUsageServerAuth, f.ServerCert, f.ServerKey); err != nil {
		return err
	}
	return issue(ca, caKey, 3, "client", x509.ExtKeyUsageClientAuth, f.ClientCert, f.ClientKey)
}

// certTemplate is a certificate for 127.0.0.1 and localhost, valid from an
// hour ago (clocks differ a little) to a day from now.
func certTemplate(serial int64, name string) *x509.Certificate {
	return &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
	}
}

// issue signs a certificate for usage with ca and writes it and its new
// key to certPath and keyPath.
func issue(ca *x509.Certificate, caKey *ecdsa.PrivateKey, serial int64, name string, usage x509.ExtKeyUsage, certPath, keyPath string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := certTemplate(serial, name)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{usage}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	if err := writePEM(certPath, "CERTIFICATE", der); err != nil {
		return err
	}
	return writePEM(keyPath, "PRIVATE KEY", keyDER)
}

func writePEM(path, kind string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600)
}

// ClientConfig is a client's TLS configuration for a server with f's server
// certificate: it trusts f's authority only, verifies the server's name as
// usual (dial 127.0.0.1 or localhost), and presents f's client certificate.
func (f TLSFiles) ClientConfig(t testing.TB) *tls.Config {
	t.Helper()
	pemCA, err := os.ReadFile(f.CA)
	if err != nil {
		t.Fatalf("testserver: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pemCA) {
		t.Fatalf("testserver: no certificate in %s", f.CA)
	}
	cert, err := tls.LoadX509KeyPair(f.ClientCert, f.ClientKey)
	if err != nil {
		t.Fatalf("testserver: %v", err)
	}
	return &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
}

// StartRedisTLS is StartRedis with TLS on a second port as well, tlsAddr
// ("127.0.0.1:port"), which serves f's server certificate and requires a
// client certificate issued by f's authority. r.Addr stays plain TCP, for
// the test's own set-up (and the readiness PING); Restart keeps both ports.
func StartRedisTLS(t testing.TB, f TLSFiles, extraArgs ...string) (r *Redis, tlsAddr string) {
	t.Helper()
	var port int
	r = startRedis(t, 2, func(ports []int, _ string) []string {
		port = ports[1]
		return append([]string{
			"--tls-port", strconv.Itoa(port),
			"--tls-cert-file", f.ServerCert,
			"--tls-key-file", f.ServerKey,
			"--tls-ca-cert-file", f.CA,
			"--tls-auth-clients", "yes",
		}, extraArgs...)
	})
	return r, net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

// PostgresConfig is what StartPostgresWith sets up beyond StartPostgres.
type PostgresConfig struct {
	// Files are written into the data directory before the server starts,
	// by name, owned by the server's user with mode 0600 (what PostgreSQL
	// requires of a key file): server.crt and server.key, say.
	Files map[string][]byte
	// Settings are server parameters, "name=value" each, passed as -c on
	// the server's command line; a value must need no shell quoting
	// ("ssl=on", "ssl_min_protocol_version=TLSv1.3").
	Settings []string
}

// StartPostgresWith is StartPostgres with cfg's files and settings: for
// TLS, Files{"server.crt": cert, "server.key": key} and Settings{"ssl=on"}
// (PostgreSQL's defaults name those two files in the data directory).
func StartPostgresWith(t testing.TB, cfg PostgresConfig) *Postgres {
	t.Helper()
	for _, s := range cfg.Settings {
		if !plainSetting(s) {
			t.Fatalf("testserver: setting %q is not name=value without spaces or quotes", s)
		}
	}
	return startPostgres(t, cfg)
}

// plainSetting reports whether s is name=value with nothing pg_ctl's shell
// would read otherwise.
func plainSetting(s string) bool {
	for _, r := range s {
		if !(r == '=' || r == '_' || r == '.' || r == '-' || r == '/' || r == ':' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			return false
		}
	}
	return len(s) > 0
}

// writeDataFiles writes files into dir, owned by uid:gid when uid >= 0.
func writeDataFiles(dir string, uid, gid int, files map[string][]byte) error {
	for name, b := range files {
		p := filepath.Join(dir, name)
		if filepath.Base(name) != name {
			return fmt.Errorf("testserver: data file %q must be a plain name", name)
		}
		if err := os.WriteFile(p, b, 0o600); err != nil {
			return fmt.Errorf("testserver: %w", err)
		}
		if uid >= 0 {
			if err := os.Chown(p, uid, gid); err != nil {
				return fmt.Errorf("testserver: chown %s: %w", p, err)
			}
		}
	}
	return nil
}

// StartPostgresTLS is StartPostgres serving f's server certificate, and
// accepting TCP connections over TLS only, from clients with a certificate
// of f's authority (hostssl, clientcert=verify-ca): p.DSN, which asks for no
// TLS, is refused; TLSDSN is the one to use.
func StartPostgresTLS(t testing.TB, f TLSFiles) *Postgres {
	t.Helper()
	files := map[string][]byte{
		// The whole file: local socket connections (pg_ctl's) as before,
		// TCP ones over TLS with a client certificate only.
		"pg_hba.conf": []byte("local all all trust\nhostssl all all 127.0.0.1/32 trust clientcert=verify-ca\n"),
	}
	for name, path := range map[string]string{"server.crt": f.ServerCert, "server.key": f.ServerKey, "ca.crt": f.CA} {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("testserver: %v", err)
		}
		files[name] = b
	}
	return StartPostgresWith(t, PostgresConfig{Files: files, Settings: []string{"ssl=on", "ssl_ca_file=ca.crt"}})
}

// TLSDSN is p.DSN for a server from StartPostgresTLS: it verifies the
// server's certificate and name against f's authority (sslmode=verify-full,
// sslrootcert) and presents f's client certificate (sslcert, sslkey).
func (p *Postgres) TLSDSN(f TLSFiles) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=verify-full&sslrootcert=%s&sslcert=%s&sslkey=%s",
		p.Port, f.CA, f.ClientCert, f.ClientKey)
}
