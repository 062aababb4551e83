/* phub's C shim: DPDK's static inline fast-path functions (which bindgen
 * cannot bind) wrapped as real functions, and the rte_flow rule phub uses. */
#ifndef PHUB_SHIM_H
#define PHUB_SHIM_H

#include <stdint.h>

struct rte_mbuf;
struct rte_mempool;
struct rte_ring;
struct rte_flow;

uint16_t phub_rx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n);
uint16_t phub_tx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n);

struct rte_mbuf *phub_pktmbuf_alloc(struct rte_mempool *mp);
int phub_pktmbuf_alloc_bulk(struct rte_mempool *mp, struct rte_mbuf **mbufs, unsigned int n);
void phub_pktmbuf_free(struct rte_mbuf *m);
void *phub_mtod(struct rte_mbuf *m);
char *phub_pktmbuf_append(struct rte_mbuf *m, uint16_t len);
void phub_pktmbuf_attach(struct rte_mbuf *mi, struct rte_mbuf *m);
int phub_pktmbuf_chain(struct rte_mbuf *head, struct rte_mbuf *tail);
uint16_t phub_mbuf_refcnt_update(struct rte_mbuf *m, int16_t v);
uint16_t phub_pktmbuf_tailroom(const struct rte_mbuf *m);
uint16_t phub_pktmbuf_data_room_size(struct rte_mempool *mp);
/* Asks the device to fill in the IPv4 header checksum and the UDP checksum
 * of the frame m starts (headers of l2, l3 and l4 bytes in its first
 * segment; the UDP checksum field holding the pseudo-header's sum). */
void phub_mbuf_tx_udp_cksum(struct rte_mbuf *m, uint16_t l2, uint16_t l3, uint16_t l4);

int phub_errno(void);
unsigned int phub_lcore_id(void);

unsigned int phub_ring_enqueue_burst(struct rte_ring *r, void *const *objs, unsigned int n);
unsigned int phub_ring_dequeue_burst(struct rte_ring *r, void **objs, unsigned int n);
unsigned int phub_ring_count(const struct rte_ring *r);

/* Offload and flag bits defined with RTE_BIT64 (bindgen cannot evaluate it). */
uint64_t phub_rx_offload_ipv4_cksum(void);
uint64_t phub_rx_offload_udp_cksum(void);
uint64_t phub_rx_offload_scatter(void);
uint64_t phub_tx_offload_multi_segs(void);
uint64_t phub_tx_offload_mbuf_fast_free(void);
uint64_t phub_tx_offload_ipv4_cksum(void);
uint64_t phub_tx_offload_udp_cksum(void);
uint64_t phub_rss_ip_udp(void);
uint64_t phub_rx_ip_cksum_mask(void);
uint64_t phub_rx_ip_cksum_bad(void);
uint64_t phub_rx_l4_cksum_mask(void);
uint64_t phub_rx_l4_cksum_bad(void);

/* Creates (or, with validate_only, only validates) the rule
 * "ETH / IPV4 / UDP dst is udp_dst -> QUEUE queue" on port. Returns 0 and
 * sets *out (when creating), or a negative errno with *msg set to the
 * driver's message (possibly NULL). */
int phub_flow_udp_dst_to_queue(uint16_t port, uint16_t udp_dst, uint16_t queue,
                               int validate_only, struct rte_flow **out, const char **msg);

#endif
