//! The parts of the NVMe 1.4 base specification this driver uses: register
//! offsets, queue entry layouts, opcodes and identify fields.

pub const REG_CAP: usize = 0x00;
pub const REG_VS: usize = 0x08;
pub const REG_CC: usize = 0x14;
pub const REG_CSTS: usize = 0x1c;
pub const REG_AQA: usize = 0x24;
pub const REG_ASQ: usize = 0x28;
pub const REG_ACQ: usize = 0x30;
pub const DOORBELL_BASE: usize = 0x1000;

pub const CC_EN: u32 = 1;
/// 64-byte submission and 16-byte completion entries, 4 KiB pages, NVM
/// command set, round-robin arbitration.
pub const CC_IO_ENTRY_SIZES: u32 = (6 << 16) | (4 << 20);
pub const CC_SHN_NORMAL: u32 = 1 << 14;
pub const CSTS_RDY: u32 = 1;
pub const CSTS_CFS: u32 = 1 << 1;
pub const CSTS_SHST_MASK: u32 = 3 << 2;
pub const CSTS_SHST_COMPLETE: u32 = 2 << 2;

pub const ADMIN_DELETE_SQ: u8 = 0x00;
pub const ADMIN_CREATE_SQ: u8 = 0x01;
pub const ADMIN_DELETE_CQ: u8 = 0x04;
pub const ADMIN_CREATE_CQ: u8 = 0x05;
pub const ADMIN_IDENTIFY: u8 = 0x06;
pub const ADMIN_SET_FEATURES: u8 = 0x09;
pub const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;
pub const IDENTIFY_NAMESPACE: u32 = 0;
pub const IDENTIFY_CONTROLLER: u32 = 1;

pub const IO_FLUSH: u8 = 0x00;
pub const IO_WRITE: u8 = 0x01;
pub const IO_READ: u8 = 0x02;
pub const IO_DATASET_MANAGEMENT: u8 = 0x09;
pub const DSM_DEALLOCATE: u32 = 1 << 2;

/// Generic command status: LBA out of range.
pub const STATUS_LBA_OUT_OF_RANGE: u8 = 0x80;

/// Controller capabilities (CAP).
#[derive(Clone, Copy, Debug)]
pub struct Capabilities(pub u64);

impl Capabilities {
    /// Largest queue the controller accepts, in entries.
    pub fn max_queue_entries(self) -> u32 {
        (self.0 & 0xffff) as u32 + 1
    }
    /// How long CSTS.RDY may take to change, in milliseconds.
    pub fn ready_timeout_ms(self) -> u64 {
        ((self.0 >> 24) & 0xff).max(1) * 500
    }
    pub fn doorbell_stride(self) -> usize {
        4 << ((self.0 >> 32) & 0xf)
    }
    pub fn supports_nvm_command_set(self) -> bool {
        (self.0 >> 37) & 1 == 1
    }
    /// Smallest memory page size, in bytes.
    pub fn min_page_bytes(self) -> u64 {
        1 << (12 + ((self.0 >> 48) & 0xf))
    }
}

/// A submission queue entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Command {
    /// Opcode in bits 0–7, command identifier in bits 16–31 (PRPs, not SGLs).
    pub cdw0: u32,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub prp1: u64,
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<Command>() == 64);

impl Command {
    pub fn new(opcode: u8) -> Self {
        Self { cdw0: u32::from(opcode), ..Self::default() }
    }
    pub fn opcode(&self) -> u8 {
        self.cdw0 as u8
    }
    pub fn set_cid(&mut self, cid: u16) {
        self.cdw0 = (self.cdw0 & 0xffff) | (u32::from(cid) << 16);
    }
    /// A read or write of `blocks` logical blocks from `lba`.
    pub fn rw(opcode: u8, nsid: u32, lba: u64, blocks: u32) -> Self {
        debug_assert!((1..=1 << 16).contains(&blocks));
        Self { nsid, cdw10: lba as u32, cdw11: (lba >> 32) as u32, cdw12: blocks - 1, ..Self::new(opcode) }
    }
}

/// A completion queue entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CompletionEntry {
    pub result: u32,
    pub reserved: u32,
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    /// Phase tag in bit 0, status field above it.
    pub status: u16,
}

const _: () = assert!(std::mem::size_of::<CompletionEntry>() == 16);

impl CompletionEntry {
    #[cfg(test)]
    pub fn phase(&self) -> bool {
        self.status & 1 == 1
    }
    /// Status code type and status code; (0, 0) is success.
    pub fn status_code(&self) -> (u8, u8) {
        let s = self.status >> 1;
        (((s >> 8) & 0x7) as u8, s as u8)
    }
    pub fn ok(&self) -> bool {
        self.status_code() == (0, 0)
    }
}

/// Identify Controller, the fields used.
#[derive(Clone, Debug)]
pub struct ControllerInfo {
    pub vendor_id: u16,
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// Largest transfer in units of the minimum page size, as a power of
    /// two; 0 means no limit.
    pub mdts: u8,
    pub namespaces: u32,
    pub dataset_management: bool,
    pub volatile_write_cache: bool,
}

impl ControllerInfo {
    pub fn parse(data: &[u8; 4096]) -> Self {
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&data[r]).trim_matches(|c: char| c == '\0' || c.is_whitespace()).to_string()
        };
        let oncs = u16::from_le_bytes([data[520], data[521]]);
        Self {
            vendor_id: u16::from_le_bytes([data[0], data[1]]),
            serial: text(4..24),
            model: text(24..64),
            firmware: text(64..72),
            mdts: data[77],
            namespaces: u32::from_le_bytes([data[516], data[517], data[518], data[519]]),
            dataset_management: oncs & (1 << 2) != 0,
            volatile_write_cache: data[525] & 1 != 0,
        }
    }
}

/// Identify Namespace, the fields used.
#[derive(Clone, Copy, Debug)]
pub struct NamespaceInfo {
    pub size_blocks: u64,
    pub block_bytes: u32,
    pub metadata_bytes: u16,
    /// Deallocated blocks read back as zeros.
    pub deallocated_reads_zero: bool,
}

impl NamespaceInfo {
    pub fn parse(data: &[u8; 4096]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(data[o..o + 8].try_into().expect("8 bytes"));
        let format = (data[26] & 0xf) as usize;
        let lbaf = u32::from_le_bytes(data[128 + 4 * format..132 + 4 * format].try_into().expect("4 bytes"));
        let lbads = (lbaf >> 16) & 0xff;
        Self {
            size_blocks: u64_at(0),
            block_bytes: if (9..=16).contains(&lbads) { 1 << lbads } else { 0 },
            metadata_bytes: lbaf as u16,
            deallocated_reads_zero: data[33] & 0x7 == 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_encode_as_the_specification_lays_them_out() {
        let mut c = Command::rw(IO_WRITE, 1, 0x1_2345_6789, 8);
        c.set_cid(0xbeef);
        assert_eq!(c.cdw0, 0xbeef_0001);
        assert_eq!((c.cdw10, c.cdw11, c.cdw12), (0x2345_6789, 1, 7));
        assert_eq!(c.opcode(), IO_WRITE);
        // Status: phase 1, SCT 0, SC 0x80 (LBA out of range).
        let e = CompletionEntry { status: (0x80 << 1) | 1, ..Default::default() };
        assert!(e.phase());
        assert_eq!(e.status_code(), (0, STATUS_LBA_OUT_OF_RANGE));
        assert!(!e.ok());
        let cap = Capabilities(0x0000_0020_1400_07ff);
        assert_eq!(cap.max_queue_entries(), 2048);
        assert_eq!(cap.ready_timeout_ms(), 10_000);
        assert_eq!(cap.doorbell_stride(), 4);
        assert!(cap.supports_nvm_command_set());
        assert_eq!(cap.min_page_bytes(), 4096);
    }

    #[test]
    fn identify_fields_parse() {
        let mut c = [0u8; 4096];
        c[0] = 0x36;
        c[1] = 0x1b;
        c[4..9].copy_from_slice(b"S1234");
        c[24..29].copy_from_slice(b"QEMU ");
        c[77] = 7;
        c[516] = 1;
        c[520] = 0b100;
        c[525] = 1;
        let info = ControllerInfo::parse(&c);
        assert_eq!((info.vendor_id, info.serial.as_str(), info.model.as_str()), (0x1b36, "S1234", "QEMU"));
        assert_eq!((info.mdts, info.namespaces), (7, 1));
        assert!(info.dataset_management && info.volatile_write_cache);

        let mut n = [0u8; 4096];
        n[0..8].copy_from_slice(&(1u64 << 21).to_le_bytes());
        n[26] = 1; // format 1
        n[33] = 1;
        n[132..136].copy_from_slice(&(12u32 << 16).to_le_bytes());
        let ns = NamespaceInfo::parse(&n);
        assert_eq!((ns.size_blocks, ns.block_bytes, ns.metadata_bytes), (1 << 21, 4096, 0));
        assert!(ns.deallocated_reads_zero);
    }
}
