package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// authority signs every certificate of one cluster; a fresh one is made at each start.
type authority struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// validity is long enough for any test run and short enough to never be mistaken for real PKI.
const validity = 7 * 24 * time.Hour

func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func serial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
}

func newAuthority(dir string) (*authority, error) {
	key, err := newKey()
	if err != nil {
		return nil, err
	}
	number, err := serial()
	if err != nil {
		return nil, err
	}
	template := &x509.Certificate{
		SerialNumber:          number,
		Subject:               pkix.Name{CommonName: "harvest-test-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, template, template, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &authority{cert: cert, key: key}
	return ca, writePair(dir, "ca", der, key)
}

// issue writes NAME.crt and NAME.key: a client certificate for user/groups, or a serving one
// when hosts are given.
func (ca *authority) issue(dir, name, user string, groups []string, hosts []string) error {
	key, err := newKey()
	if err != nil {
		return err
	}
	number, err := serial()
	if err != nil {
		return err
	}
	template := &x509.Certificate{
		SerialNumber: number,
		Subject:      pkix.Name{CommonName: user, Organization: groups},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if len(hosts) > 0 {
		template.ExtKeyUsage = append(template.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		for _, host := range hosts {
			if ip := net.ParseIP(host); ip != nil {
				template.IPAddresses = append(template.IPAddresses, ip)
			} else {
				template.DNSNames = append(template.DNSNames, host)
			}
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, template, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return err
	}
	return writePair(dir, name, der, key)
}

func writePair(dir, name string, der []byte, key *ecdsa.PrivateKey) error {
	keyDer, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	crt := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := os.WriteFile(filepath.Join(dir, name+".crt"), crt, 0o644); err != nil {
		return err
	}
	pemKey := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDer})
	return os.WriteFile(filepath.Join(dir, name+".key"), pemKey, 0o600)
}

// writeServiceAccountKey writes the key pair that signs and verifies ServiceAccount tokens.
func writeServiceAccountKey(dir string) error {
	key, err := newKey()
	if err != nil {
		return err
	}
	keyDer, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	pubDer, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "sa.key"),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDer}), 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "sa.pub"),
		pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDer}), 0o644)
}

// writeKubeconfig writes a kubeconfig that authenticates with the client certificate NAME.
func writeKubeconfig(path, pki, server, name string) error {
	text := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: harvest-real
  cluster:
    server: %s
    certificate-authority: %s
contexts:
- name: %s@harvest-real
  context:
    cluster: harvest-real
    user: %s
current-context: %s@harvest-real
users:
- name: %s
  user:
    client-certificate: %s
    client-key: %s
`, server, filepath.Join(pki, "ca.crt"), name, name, name, name,
		filepath.Join(pki, name+".crt"), filepath.Join(pki, name+".key"))
	return os.WriteFile(path, []byte(text), 0o600)
}
